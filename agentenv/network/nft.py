"""nftables commands through libnftables in this process, not an `nft` process per command.

`nft` is a front end of libnftables (Debian's `libnftables1`, a dependency of the `nftables`
package): the same parser, the same netlink transactions. Each `nft` run costs a process start
(~10–20 ms, ~5 ms of CPU here); a sandbox's bring-up and teardown made three of them (its netns
rules through `nsenter` + `sh`, the root table's `internet` element added, then deleted). The
library's C API is small and stable (`nft_ctx_new`, `nft_run_cmd_from_buffer`, its output and error
buffers: what the python3-nftables binding wraps); it is called here through ctypes.

Commands inside a slot run in a short-lived thread of ours that entered the slot's netns
(`nsock.in_own_thread`): libnftables' netlink socket, made in that thread, lives there. The netns' sysctls are
written by that thread too (/proc/sys/net is the calling thread's namespace). One lock serialises
every call: libnftables keeps some global state, and each call takes ~1 ms.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import threading

from agentenv.errors import RuntimeFailure
from agentenv.network.nsock import enter_netns, in_own_thread

TIMEOUT_S = 10.0   # netlink has no deadline of its own: a lost answer must not hang the caller
_LOCK = threading.Lock()
_lib: ctypes.CDLL | None = None


def _library() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(ctypes.util.find_library("nftables") or "libnftables.so.1", use_errno=True)
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
        for name in ("nft_ctx_buffer_output", "nft_ctx_buffer_error"):
            getattr(lib, name).argtypes = [ctypes.c_void_p]
            getattr(lib, name).restype = ctypes.c_int
        for name in ("nft_ctx_get_output_buffer", "nft_ctx_get_error_buffer"):
            getattr(lib, name).argtypes = [ctypes.c_void_p]
            getattr(lib, name).restype = ctypes.c_char_p
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
        _lib = lib
    return _lib


class NftError(RuntimeFailure):
    """libnftables refused a command; the message is its error output."""


def run_here(script: str) -> str:
    """`run` in the calling thread and its netns (blocks ~1 ms; for code already off the event loop)."""
    lib = _library()
    with _LOCK:
        ctx = lib.nft_ctx_new(0)
        if not ctx:
            raise NftError("nft: cannot create a libnftables context")
        try:
            lib.nft_ctx_buffer_output(ctx)
            lib.nft_ctx_buffer_error(ctx)
            rc = lib.nft_run_cmd_from_buffer(ctx, script.encode())
            out = (lib.nft_ctx_get_output_buffer(ctx) or b"").decode(errors="replace")
            err = (lib.nft_ctx_get_error_buffer(ctx) or b"").decode(errors="replace")
        finally:
            lib.nft_ctx_free(ctx)
    if rc != 0:
        raise NftError(err.strip()[-500:] or f"nft: command failed ({rc})")
    return out


async def run(script: str, *, netns_path: str | None = None, sysctls: dict[str, str] | None = None) -> str:
    """Run an nft script (what `nft -f -` reads) in the root netns or in `netns_path`, after writing
    `sysctls` (/proc/sys/... path → value) there; its output (`list` commands). Raises NftError."""
    def work() -> str:
        try:
            if netns_path is not None:
                enter_netns(netns_path)
            for path, value in (sysctls or {}).items():
                with open(path, "w") as f:
                    f.write(value)
            return run_here(script)
        except RuntimeFailure:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. the netns is gone
            raise RuntimeFailure(f"nft: {e}") from e

    try:
        async with asyncio.timeout(TIMEOUT_S):
            return await in_own_thread(work, name="nft")
    except TimeoutError:
        raise RuntimeFailure(f"nft: no answer from the kernel after {TIMEOUT_S:.0f} s") from None
