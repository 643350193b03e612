"""A bookie's presence in ZooKeeper: the cookie check on start, and an
ephemeral registration as writable or read-only that follows the bookie's mode
and is made again whenever the ZooKeeper session is replaced."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import trio

from bookie.cookie import (
    Cookie,
    check_cookies,
    directory_is_empty,
    read_directory_cookie,
    write_directory_cookie,
)
from coordination.async_store import AsyncMetadataStore
from coordination.cluster_layout import BookieRegistrationInfo, ClusterLayout, ensure_cluster_layout
from coordination.store import NoNodeError, NodeExistsError

log = logging.getLogger(__name__)


async def check_and_write_cookies(
    store: AsyncMetadataStore, layout: ClusterLayout, bookie_id: str, journal_dir: Path, ledger_dir: Path
) -> tuple[Cookie, bool]:
    """Raise CookieError unless the directories are this bookie's own; for a
    new bookie, write its cookies (directories first, ZooKeeper last, so that
    a crash in between leaves a state the next start can finish). Returns
    the cookie and whether the bookie is new."""
    instance_id = await trio.to_thread.run_sync(ensure_cluster_layout, store.store, layout)
    directories = [str(Path(journal_dir).resolve()), str(Path(ledger_dir).resolve())]
    expected = Cookie(instance_id, bookie_id, directories[0], directories[1])
    try:
        data, _ = await store.get(layout.cookie(bookie_id))
        registered: Cookie | None = Cookie.from_bytes(data, f"ZooKeeper {layout.cookie(bookie_id)}")
    except NoNodeError:
        registered = None
    directory_cookies = {directory: read_directory_cookie(Path(directory)) for directory in directories}
    directories_empty = {directory: directory_is_empty(Path(directory)) for directory in directories}
    # A start that crashed after writing the directory cookies but before the
    # ZooKeeper one left matching cookies in still-empty directories: finish it.
    unfinished = registered is None and all(
        cookie == expected for cookie in directory_cookies.values()
    ) and all(directory_is_empty(Path(directory)) for directory in directories)
    if unfinished:
        directory_cookies = {directory: None for directory in directories}
        directories_empty = {directory: True for directory in directories}
    new = check_cookies(expected, registered, directory_cookies, directories_empty)
    if new:
        for directory in directories:
            await trio.to_thread.run_sync(write_directory_cookie, Path(directory), expected)
        try:
            await store.create(layout.cookie(bookie_id), expected.to_bytes())
        except NodeExistsError:
            # Another process raced us with the same bookie id: let the
            # comparison decide, as on any start.
            data, _ = await store.get(layout.cookie(bookie_id))
            check_cookies(expected, Cookie.from_bytes(data, "ZooKeeper"), {d: expected for d in directories}, {})
        log.info("new bookie %s: cookies written", bookie_id)
    return expected, new


async def format_bookie(store: AsyncMetadataStore, layout: ClusterLayout, bookie_id: str, directories: list[Path]) -> None:
    """Forget a bookie: delete its ZooKeeper cookie and empty its directories,
    so that it next starts as a new bookie."""
    try:
        await store.delete(layout.cookie(bookie_id))
    except NoNodeError:
        pass
    for directory in directories:
        await trio.to_thread.run_sync(_empty_directory, Path(directory))


def _empty_directory(directory: Path) -> None:
    if not directory.exists():
        return
    for child in directory.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


class Registration:
    """Keeps one ephemeral node for the bookie under writable/ or readonly/."""

    def __init__(
        self,
        store: AsyncMetadataStore,
        layout: ClusterLayout,
        info: BookieRegistrationInfo,
        *,
        stale_wait_s: float,
    ) -> None:
        self.store = store
        self.layout = layout
        self.info = info
        self.stale_wait_s = stale_wait_s
        self.read_only = info.read_only
        self.registered = trio.Event()
        self._changed = trio.Event()
        self._stopped = False

    def set_read_only(self, read_only: bool) -> None:
        if read_only != self.read_only:
            self.read_only = read_only
            self._changed.set()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Register, then re-register on every mode change or new session."""
        task_status.started()
        while not self._stopped:
            generation = self.store.session_generation
            # Armed before registering, so that a mode change during the
            # ZooKeeper calls is not lost: it makes this loop go round again.
            self._changed = trio.Event()
            registered_read_only = self.read_only
            await self._register(registered_read_only)
            self.registered.set()
            if self.read_only != registered_read_only:
                continue
            async with trio.open_nursery() as nursery:

                async def wait_session() -> None:
                    await self.store.wait_session_change(generation)
                    nursery.cancel_scope.cancel()

                async def wait_mode() -> None:
                    await self._changed.wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(wait_session)
                nursery.start_soon(wait_mode)

    async def _register(self, read_only: bool) -> None:
        info = BookieRegistrationInfo(self.info.bookie_id, self.info.address, self.info.rack, read_only)
        path = self.layout.bookie_registration(info.bookie_id, read_only=read_only)
        other = self.layout.bookie_registration(info.bookie_id, read_only=not read_only)
        session_id = self.store.store.session_id
        # Leave the other list first: a client must never see the bookie
        # writable after it turned read-only.
        await self._delete_own(other, session_id)
        while True:
            try:
                await self.store.create(path, info.to_bytes(), ephemeral=True)
                break
            except NodeExistsError:
                stat, gone = await self.store.exists_watch(path)
                if stat is None:
                    continue
                if stat.ephemeral_owner == session_id:
                    await self.store.set(path, info.to_bytes())
                    break
                # A registration of an earlier session of this bookie (a
                # restart within the session timeout) goes when that session
                # expires. If it outlives that, another process uses this id.
                log.info("waiting for the stale registration %s to expire", path)
                with trio.move_on_after(self.stale_wait_s) as waiting:
                    await gone.wait()
                if waiting.cancelled_caught:
                    log.warning(
                        "registration %s is still held by another ZooKeeper session after %.0fs: "
                        "is another bookie running with id %s? still waiting",
                        path, self.stale_wait_s, info.bookie_id,
                    )
        log.info("registered as %s", path)

    async def _delete_own(self, path: str, session_id: int) -> None:
        try:
            stat = await self.store.exists(path)
            if stat is not None and stat.ephemeral_owner == session_id:
                await self.store.delete(path)
        except NoNodeError:
            pass

    async def unregister(self) -> None:
        self._stopped = True
        session_id = self.store.store.session_id
        for read_only in (False, True):
            await self._delete_own(self.layout.bookie_registration(self.info.bookie_id, read_only=read_only), session_id)
