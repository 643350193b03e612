"""The pause of in-place journal fsyncs after a slow one: short at first,
longer while slow fsyncs keep coming, short again after a quiet spell."""

from bookie.server import SyncHerePause


def test_a_single_slow_fsync_pauses_briefly():
    pause = SyncHerePause(1.0, 60.0)
    assert pause.allows(0.0)
    assert pause.slow(10.0) == 1.0
    assert not pause.allows(10.5)
    assert pause.allows(11.0)


def test_slow_fsyncs_soon_after_a_pause_double_it_up_to_the_maximum():
    pause = SyncHerePause(1.0, 8.0)
    now = 0.0
    pauses = []
    for _ in range(6):
        pauses.append(pause.slow(now))
        now = pause.paused_until + 0.5  # slow again half a second after resuming
    assert pauses == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_a_quiet_spell_resets_the_pause():
    pause = SyncHerePause(1.0, 60.0)
    pause.slow(0.0)
    pause.slow(1.5)
    assert pause.pause_s == 2.0
    # Resumed at 3.5; nothing slow for well over four pauses.
    assert pause.slow(100.0) == 1.0
