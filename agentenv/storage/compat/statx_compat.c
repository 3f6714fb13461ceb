/*
 * agentenv compatibility shim for gVisor releases before mid-2023.
 *
 * Those releases reject statx(2) and fstatat(2) calls that carry AT_NO_AUTOMOUNT with EINVAL.
 * Current coreutils always pass it, so `ls`, `stat`, `cp -a` and friends fail on every path.
 * Sandboxes have no automount points, so dropping the flag changes nothing else.
 * Loaded through /etc/ld.so.preload (not LD_PRELOAD, which sudo and env -i would drop).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef AT_NO_AUTOMOUNT
#define AT_NO_AUTOMOUNT 0x800
#endif

int statx(int dirfd, const char *path, int flags, unsigned int mask, struct statx *buf)
{
    return (int)syscall(SYS_statx, dirfd, path, flags & ~AT_NO_AUTOMOUNT, mask, buf);
}

#if defined(SYS_newfstatat)
int fstatat(int dirfd, const char *path, struct stat *buf, int flags)
{
    return (int)syscall(SYS_newfstatat, dirfd, path, buf, flags & ~AT_NO_AUTOMOUNT);
}

int fstatat64(int dirfd, const char *path, struct stat64 *buf, int flags)
{
    return (int)syscall(SYS_newfstatat, dirfd, path, buf, flags & ~AT_NO_AUTOMOUNT);
}
#endif
