"""Where a quire cluster keeps its metadata inside its ZooKeeper chroot.

One place for the paths, so that bookies, clients and tools agree:
/instance_id, /cookies/<bookie>, /bookies/writable/<bookie> and
/bookies/readonly/<bookie> (ephemeral registrations, JSON data). Paths are
relative to the store's chroot (`--root`, default /quire).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass

from coordination.store import MetadataStore, NoNodeError, NodeExistsError


@dataclass(frozen=True)
class ClusterLayout:
    root: str = "/"  # inside the store's chroot

    def _path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts]) if self.root != "/" else "/" + "/".join(parts)

    @property
    def instance_id(self) -> str:
        return self._path("instance_id")

    @property
    def cookies(self) -> str:
        return self._path("cookies")

    def cookie(self, bookie_id: str) -> str:
        return self._path("cookies", bookie_id)

    @property
    def writable_bookies(self) -> str:
        return self._path("bookies", "writable")

    @property
    def readonly_bookies(self) -> str:
        return self._path("bookies", "readonly")

    def bookie_registration(self, bookie_id: str, *, read_only: bool) -> str:
        return self._path("bookies", "readonly" if read_only else "writable", bookie_id)


@dataclass(frozen=True)
class BookieRegistrationInfo:
    """The data of a bookie's registration node."""

    bookie_id: str
    address: str  # host:port clients connect to
    rack: str | None = None
    read_only: bool = False

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "BookieRegistrationInfo":
        return cls(**json.loads(data))


def ensure_cluster_layout(store: MetadataStore, layout: ClusterLayout) -> str:
    """Create the cluster's base nodes if missing; return the instance id
    (created once per cluster, race-free between concurrent callers)."""
    for path in (layout.cookies, layout.writable_bookies, layout.readonly_bookies):
        store.ensure_path(path)
    try:
        return store.get(layout.instance_id)[0].decode()
    except NoNodeError:
        pass
    try:
        store.create(layout.instance_id, uuid.uuid4().hex.encode())
    except NodeExistsError:
        pass
    return store.get(layout.instance_id)[0].decode()


def list_bookies(store: MetadataStore, layout: ClusterLayout, *, read_only: bool) -> dict[str, BookieRegistrationInfo]:
    """Registered bookies of one kind, by id (a node that vanishes while we
    read is skipped: its bookie just went away)."""
    directory = layout.readonly_bookies if read_only else layout.writable_bookies
    try:
        names = store.children(directory)
    except NoNodeError:
        return {}
    bookies = {}
    for name in names:
        try:
            data, _ = store.get(f"{directory}/{name}")
        except NoNodeError:
            continue
        bookies[name] = BookieRegistrationInfo.from_bytes(data)
    return bookies
