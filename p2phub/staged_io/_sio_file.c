/* NIXL FILE registrations, one definition for both routes (p2phub.nixl through cffi, and
 * libplugin_P2PHUB.so): the path-mode meta grammar, the open of a path-mode file and the
 * size a READ is checked against. Compiled with _sio.c (it includes this file). */

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>

static int meta_flag(const char *word, size_t n, int *flag)
{
    static const struct { const char *name; int flag; } known[] = {
        { "direct", O_DIRECT }, { "sync", O_SYNC }, { "noatime", O_NOATIME },
        { "create", O_CREAT },
    };
    size_t i;

    for (i = 0; i < sizeof(known) / sizeof(known[0]); i++)
        if (strlen(known[i].name) == n && !memcmp(word, known[i].name, n)) {
            *flag = known[i].flag;
            return 1;
        }
    return 0;
}

int sio_file_meta(const char *meta, char *path, int pathlen, int *flags, char *err, int errlen)
{
    const char *colon = strchr(meta, ':'), *p, *end;
    int mode, seen = 0;     /* a relative path is the process's, as open(2) takes it */
    size_t n;

    /* path mode starts with its access mode, "ro" or "rw", then "," or ":" */
    if (!colon || (strncmp(meta, "ro", 2) && strncmp(meta, "rw", 2)) ||
        (meta[2] != ',' && meta[2] != ':'))
        return 0;
    mode = meta[1] == 'o' ? O_RDONLY : O_RDWR;
    for (p = meta + 2; p < colon; p = end) {
        int f = 0;

        p++;                    /* the ',' */
        end = memchr(p, ',', (size_t)(colon - p));
        if (!end)
            end = colon;
        n = (size_t)(end - p);
        if (!meta_flag(p, n, &f)) {
            say(err, errlen, "FILE registration '%s': unknown flag '%.*s' (want direct, sync, "
                "noatime or create after ro or rw)", meta, (int)n, p);
            return -1;
        }
        seen |= f;      /* (a flag given twice is that flag, as NIXL's POSIX plugin reads it) */
    }
    if (!colon[1]) {
        say(err, errlen, "FILE registration '%s': no path after the colon", meta);
        return -1;
    }
    if (strlen(colon + 1) >= (size_t)pathlen) {
        say(err, errlen, "FILE registration: the path is longer than %d bytes", pathlen - 1);
        return -1;
    }
    strcpy(path, colon + 1);
    *flags = mode | seen | O_CLOEXEC;
    return 1;
}

int sio_file_open(const char *path, int flags, char *err, int errlen)
{
    struct stat st;
    int fd = open(path, flags | O_NOFOLLOW | O_CLOEXEC, 0600);

    if (fd < 0) {
        say(err, errlen, "open '%s': %s", path,
            errno == ELOOP ? "it is a symbolic link" : strerror(errno));
        return -1;
    }
    if (fstat(fd, &st) || !(S_ISREG(st.st_mode) || S_ISBLK(st.st_mode))) {
        say(err, errlen, "'%s' is not a regular file or a block device", path);
        close(fd);
        return -1;
    }
    return fd;
}

long long sio_file_size(int fd)
{
    struct stat st;
    unsigned long long bytes;

    if (fstat(fd, &st))
        return -errno;
    if (S_ISBLK(st.st_mode)) {
        if (ioctl(fd, BLKGETSIZE64, &bytes))
            return -errno;
        return (long long)bytes;
    }
    return (long long)st.st_size;
}
