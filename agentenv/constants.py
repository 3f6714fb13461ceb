"""Constants shared by the host side and the in-sandbox daemon (envd).

Kept free of imports so envd (which runs with the tools layer's interpreter) can import it too.
"""

# The envd protocol version we claim. The E2B SDKs gate features on it; >= 0.6.4 unlocks all.
ENVD_VERSION = "0.6.13"
ENVD_PORT = 49983
JUPYTER_PORT = 49999

# Every sandbox sees the same inner address; the host reaches it through a per-slot address + DNAT.
# This is what lets a checkpoint be restored into a fresh namespace (fork children) unchanged.
GUEST_IP = "169.254.0.22"
GUEST_GATEWAY_IP = "169.254.0.21"
GUEST_PREFIXLEN = 30
# Fixed (locally administered) MAC addresses of the guest link and its gateway, the same in every
# slot like the addresses: a memory image restored into another slot finds the gateway it cached in
# its ARP table (a random MAC left a restored guest sending to the old one until its ARP entry
# expired: a 1 s stall of one in ~6 creates/resumes).
GUEST_MAC = "02:a9:fe:00:00:16"
GUEST_GATEWAY_MAC = "02:a9:fe:00:00:15"

# Where the read-only tools layer (envd + its own interpreter) is mounted inside every sandbox.
TOOLS_MOUNT = "/.agentenv"

DEFAULT_USER = "user"
DEFAULT_HOME = "/home/user"

# E2B returns a constant clientID; the SDKs require the field but ignore it.
CLIENT_ID = "6532622b"

# Every sandbox's processes live in a cgroup under this parent, in the cgroupfs mounted here (one
# tree for cgroup v2, one per controller for v1): the runtimes place them, the sampler reads them.
CGROUP_ROOT = "/sys/fs/cgroup"
CGROUP_PARENT = "agentenv"
