"""The backoff of inline journal fsyncs after a slow one: short at first,
longer while slow fsyncs keep coming, short again after a quiet spell."""

from bookie.server import InlineFsyncBackoff


def test_a_single_slow_fsync_backs_off_briefly():
    backoff = InlineFsyncBackoff(1.0, 60.0)
    assert backoff.allows(0.0)
    assert backoff.slow_fsync(10.0) == 1.0
    assert not backoff.allows(10.5)
    assert backoff.allows(11.0)


def test_slow_fsyncs_soon_after_a_backoff_double_it_up_to_the_maximum():
    backoff = InlineFsyncBackoff(1.0, 8.0)
    now = 0.0
    backoffs = []
    for _ in range(6):
        backoffs.append(backoff.slow_fsync(now))
        now = backoff.backoff_until + 0.5  # slow again half a second after resuming
    assert backoffs == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_a_quiet_spell_resets_the_backoff():
    backoff = InlineFsyncBackoff(1.0, 60.0)
    backoff.slow_fsync(0.0)
    backoff.slow_fsync(1.5)
    assert backoff.backoff_s == 2.0
    # Resumed at 3.5; nothing slow for well over four backoffs.
    assert backoff.slow_fsync(100.0) == 1.0
