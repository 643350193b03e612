# quire on Debian 12: Python 3.11, Debian's ZooKeeper and a Java runtime.
# The same image runs every role: `quire zk run`, `quire bookie run`, ...
FROM debian:bookworm-slim
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv default-jre-headless zookeeper \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/quire
COPY pyproject.toml README.md ./
COPY coordination coordination
COPY bookie bookie
COPY ledger_client ledger_client
COPY broker broker
COPY sim sim
COPY quire quire
COPY bench bench
RUN python3 -m venv /opt/quire/.venv && /opt/quire/.venv/bin/pip install --no-cache-dir .
ENV PATH=/opt/quire/.venv/bin:$PATH
ENTRYPOINT ["quire"]
