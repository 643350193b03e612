"""A bookie's presence in ZooKeeper: the cookie check on start, and an
ephemeral registration as writable or read-only that follows the bookie's mode
and is made again whenever the ZooKeeper session is replaced."""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path
from typing import Iterator

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
from coordination.retry import RetryPolicy
from coordination.startup import RETRYABLE
from coordination.store import MetadataError, NoNodeError, NodeExistsError

log = logging.getLogger(__name__)
# Delays between tries of a registration that ZooKeeper failed: growing over
# the first tries, then `delay_max_ms` each (see Registration).
REGISTRATION_RETRY = RetryPolicy(tries_max=10, delay_initial_ms=100.0, delay_max_ms=2_000.0)


class CookieCheck:
    """The cookie check of one start. ZooKeeper may fail it half-way (the
    connection or the session lost), and then it is simply run again; so it
    remembers that this process found the bookie new and began writing its
    cookies. A later run that finds exactly this process's own cookies on
    still-empty directories then finishes the job and still reports the
    bookie new (so that its index gets the identity), where a fresh process
    finding the same cookies would rightly treat the bookie as known.
    Nothing is written twice in a way that could change it: the directory
    cookies only ever get the expected cookie, and the ZooKeeper cookie is
    only ever created, never overwritten."""

    def __init__(
        self, store: AsyncMetadataStore, layout: ClusterLayout, bookie_id: str, journal_dir: Path, ledger_dir: Path
    ) -> None:
        self.store = store
        self.layout = layout
        self.bookie_id = bookie_id
        self.directories = [str(Path(journal_dir).resolve()), str(Path(ledger_dir).resolve())]
        self.writing_new = False  # this process decided the bookie is new and began writing its cookies

    async def run(self) -> tuple[Cookie, bool]:
        """Raise CookieError unless the directories are this bookie's own; for
        a new bookie, write its cookies (directories first, ZooKeeper last, so
        that a crash in between leaves a state the next start can finish).
        Returns the cookie and whether the bookie is new."""
        store, layout, bookie_id, directories = self.store, self.layout, self.bookie_id, self.directories
        # Abandoned if the start-up deadline passes: each kazoo call retries
        # on its own for longer than a start-up should wait.
        instance_id = await trio.to_thread.run_sync(ensure_cluster_layout, store.store, layout, abandon_on_cancel=True)
        expected = Cookie(instance_id, bookie_id, directories[0], directories[1])
        try:
            data, _ = await store.get(layout.cookie(bookie_id))
            registered: Cookie | None = Cookie.from_bytes(data, f"ZooKeeper {layout.cookie(bookie_id)}")
        except NoNodeError:
            registered = None
        directory_cookies = {directory: read_directory_cookie(Path(directory)) for directory in directories}
        directories_empty = {directory: directory_is_empty(Path(directory)) for directory in directories}
        all_empty = all(directories_empty.values())
        # A start that crashed after writing the directory cookies but before the
        # ZooKeeper one left matching cookies in still-empty directories: finish it.
        unfinished = registered is None and all(
            cookie == expected for cookie in directory_cookies.values()
        ) and all_empty
        # This process's own earlier try, cut short by ZooKeeper: any of its
        # cookies may be written, each one complete (files are replaced
        # atomically, the node is created at once).
        resumed = self.writing_new and registered in (None, expected) and all(
            cookie in (None, expected) for cookie in directory_cookies.values()
        ) and all_empty
        if unfinished or resumed:
            new = True
        else:
            new = check_cookies(expected, registered, directory_cookies, directories_empty)
        if new:
            self.writing_new = True
            for directory in directories:
                if directory_cookies[directory] != expected:
                    await trio.to_thread.run_sync(write_directory_cookie, Path(directory), expected)
            if registered is None:
                try:
                    await store.create(layout.cookie(bookie_id), expected.to_bytes())
                except NodeExistsError:
                    # Another process raced us with the same bookie id, or our
                    # own create went through before the connection was lost:
                    # let the comparison decide, as on any start.
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
    """Keeps one ephemeral node for the bookie under writable/ or readonly/
    (making the lists' nodes too if they are gone, as BookKeeper does).

    ZooKeeper failing a registration (the connection or the session lost, no
    answer in time) is tried again with backoff and jitter, for as long as
    the bookie runs: unbounded in tries, like kazoo's own reconnecting, since
    a bookie that gave up would serve without ever being found again; the
    delay between tries is bounded, and the bookie's start-up deadline bounds
    the wait for its first registration.

    Any other error (ZooKeeper refusing the bookie, the store closed) ends
    the first registration at once: `refused` is set, with the error in
    `refusal`, and the bookie stops with one line saying why. Once the
    bookie has been registered and serves, such an error is logged and
    tried again like the others: a serving bookie never stops over its
    registration."""

    def __init__(
        self,
        store: AsyncMetadataStore,
        layout: ClusterLayout,
        info: BookieRegistrationInfo,
        *,
        stale_wait_s: float,
        retry: RetryPolicy = REGISTRATION_RETRY,
        rng: random.Random | None = None,
    ) -> None:
        self.store = store
        self.layout = layout
        self.info = info
        self.stale_wait_s = stale_wait_s
        self.retry = retry
        self.rng = rng if rng is not None else random.Random()
        self.read_only = info.read_only
        self.registered = trio.Event()
        self.refused = trio.Event()  # the first registration failed for good (see `refusal`)
        self.refusal: MetadataError | None = None
        self.last_error: Exception | None = None  # why the last try failed, until one succeeds
        self.stale_owner: int | None = None  # the other session holding our node while we wait for it
        self._changed = trio.Event()
        self._stopped = False

    def set_read_only(self, read_only: bool) -> None:
        if read_only != self.read_only:
            self.read_only = read_only
            self._changed.set()

    def problem(self) -> str | None:
        """Why the bookie is not registered yet, for the start-up error line."""
        if self.stale_owner is not None:
            return (
                f"its registration is still held by another ZooKeeper session (0x{self.stale_owner:x}) that has not "
                f"expired: is another bookie running with id {self.info.bookie_id}?"
            )
        if self.last_error is not None:
            return str(self.last_error) or type(self.last_error).__name__
        return None

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Register, then re-register on every mode change or new session.
        Returns only when the first registration is refused (`refused`)."""
        task_status.started()
        delays_ms: Iterator[float] | None = None
        while not self._stopped:
            generation = self.store.session_generation
            # Armed before registering, so that a mode change during the
            # ZooKeeper calls is not lost: it makes this loop go round again.
            self._changed = trio.Event()
            registered_read_only = self.read_only
            try:
                await self._register(registered_read_only)
            except MetadataError as error:
                if not isinstance(error, RETRYABLE) and not self.registered.is_set():
                    self.refusal = error
                    self.refused.set()
                    return
                self.last_error = error
                if delays_ms is None:
                    delays_ms = self.retry.iter_delays_ms(self.rng)
                delay_ms = next(delays_ms, self.retry.delay_max_ms)
                log.warning("registering bookie %s failed (%s); trying again in %.1fs", self.info.bookie_id, error, delay_ms / 1000)
                await trio.sleep(delay_ms / 1000)
                continue
            delays_ms = None
            self.last_error = None
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
        info = BookieRegistrationInfo(self.info.bookie_id, self.info.address, self.info.rack, read_only, self.info.tls)
        path = self.layout.bookie_registration(info.bookie_id, read_only=read_only)
        other = self.layout.bookie_registration(info.bookie_id, read_only=not read_only)
        self.stale_owner = None  # as found by this try, not an earlier one
        # Leave the other list first: a client must never see the bookie
        # writable after it turned read-only.
        await self._delete_own(other, self.store.session_id)
        while True:
            try:
                await self.store.create(path, info.to_bytes(), ephemeral=True, make_parents=True)
                break
            except NodeExistsError:
                stat, gone = await self.store.exists_watch(path)
                if stat is None:
                    self.stale_owner = None
                    continue
                # The session now, not when we began: it may have been
                # replaced meanwhile, and a node of our own is ours to update.
                if stat.ephemeral_owner == self.store.session_id:
                    await self.store.set(path, info.to_bytes())
                    break
                # A registration of an earlier session of this bookie (a
                # restart within the session timeout) goes when that session
                # expires. If it outlives that, another process uses this id.
                # The watch also fires if our connection drops; then look again.
                self.stale_owner = stat.ephemeral_owner
                log.info("waiting for the stale registration %s (session 0x%x) to expire", path, stat.ephemeral_owner)
                with trio.move_on_after(self.stale_wait_s) as waiting:
                    await gone.wait()
                if waiting.cancelled_caught:
                    log.warning(
                        "registration %s is still held by another ZooKeeper session after %.0fs: "
                        "is another bookie running with id %s? still waiting",
                        path, self.stale_wait_s, info.bookie_id,
                    )
        self.stale_owner = None
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
