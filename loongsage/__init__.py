"""LoongSage: agent-native, fully asynchronous RL for LLMs."""
import os as _os

# Ray reads this once, when it is first imported: set here, at the package's entry, a local Ray keeps
# every process on 127.0.0.1 whatever a program imports first (cluster/ray_setup.py also sets Ray's
# constant directly, and switches it back when a run joins a cluster).
_os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
_os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

__version__ = "0.1.0"
