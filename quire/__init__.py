"""The `quire` command line and the local cluster launcher."""
