"""The prefix of every /dev/shm name a run makes, in a module without torch: the engines' Ray actors
import it (they only launch a server process, and importing torch there cost each ~1.7 s of start-up)."""
SHM_PREFIX = "loongsage-"  # every shared buffer's /dev/shm name starts with this (a run adds its id)
