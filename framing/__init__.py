"""Length-prefixed msgpack framing, the bottom layer both wire protocols
(`bookie.protocol`, `broker.protocol`) are built on: the pure codec
(`framing.codec`), frames over a trio stream (`framing.stream`), and what
peers may hold of a server process (`framing.peer_limits`).

Only the codec's names are re-exported here: importing `framing` (a pure
core does, through a protocol) must not load trio, so the two trio modules
are imported by their own names.
"""

from framing.codec import *  # noqa: F401,F403  (the codec's public names)
from framing.codec import __all__ as _codec_names

__all__ = list(_codec_names)
