/*
 * A fake libcuda.so.1: just enough of the CUDA driver API for bench/hardware_check.py's real
 * holder (cuInit, cuDeviceGet, cuCtxCreate_v2, cuMemAlloc_v2) to run on a machine without a
 * GPU, holding fake memory in the fake NVML's state directory the way gpu_hold.py does.
 *
 * $FAKENVML_STATE names the state directory; $FAKECUDA_MINOR the minor number of CUDA device 0
 * (the harness maps CUDA_VISIBLE_DEVICES for it; default 0). cuInit opens STATE/dev/nvidiactl
 * and nvidia-uvm, cuCtxCreate_v2 opens STATE/dev/nvidia<minor>, as the real driver opens the
 * device nodes. The first cuMemAlloc_v2 starts a watcher (double fork, setsid) that waits for
 * EOF on a pipe only this process holds, then appends released_at_ms= to the allocation file:
 * memory is released when the process is gone, however it died. The allocation names the
 * process by its host PID (/proc/self, which stays the host's procfs in a PID namespace made
 * without --mount-proc). One allocation per process: that is all the holder makes.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define API __attribute__((visibility("default")))
#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_NO_DEVICE 100
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_INVALID_CONTEXT 201

static int g_initialised;
static int g_context;
static int g_allocated;

static const char *state_dir(void)
{
    const char *dir = getenv("FAKENVML_STATE");
    return dir != NULL && dir[0] != '\0' ? dir : NULL;
}

static long minor_number(void)
{
    const char *text = getenv("FAKECUDA_MINOR");
    char *end;
    long minor;
    if (text == NULL || text[0] == '\0') {
        return 0;
    }
    errno = 0;
    minor = strtol(text, &end, 10);
    return errno == 0 && *end == '\0' && minor >= 0 && minor <= 0xFFFF ? minor : -1;
}

/* Open STATE/dev/NAME and keep it open for the life of the process (never close-on-exec). */
static int hold(const char *name)
{
    char path[PATH_MAX];
    const char *dir = state_dir();
    if (dir == NULL || snprintf(path, sizeof path, "%s/dev/%s", dir, name) >= (int)sizeof path) {
        return -1;
    }
    return open(path, O_RDWR);
}

API int cuInit(unsigned int flags)
{
    if (flags != 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (!g_initialised) {
        if (hold("nvidiactl") < 0 || hold("nvidia-uvm") < 0) {
            return CUDA_ERROR_NO_DEVICE;
        }
        g_initialised = 1;
    }
    return CUDA_SUCCESS;
}

API int cuDeviceGet(int *device, int ordinal)
{
    if (!g_initialised) {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    if (device == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (ordinal != 0 || minor_number() < 0) {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    *device = 0;
    return CUDA_SUCCESS;
}

API int cuCtxCreate_v2(void **context, unsigned int flags, int device)
{
    char name[32];
    (void)flags;
    if (!g_initialised) {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    if (context == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (device != 0) {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    snprintf(name, sizeof name, "nvidia%ld", minor_number());
    if (hold(name) < 0) {
        return CUDA_ERROR_NO_DEVICE;
    }
    g_context = 1;
    *context = &g_context;
    return CUDA_SUCCESS;
}

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* The watcher: the grandchild waits for EOF (every holder of the write end gone), then marks
 * the allocation released. Returns the pipe's write end, or -1. */
static int start_watcher(const char *alloc)
{
    int ends[2];
    pid_t child;
    if (pipe(ends) != 0) {
        return -1;
    }
    child = fork();
    if (child < 0) {
        return -1;
    }
    if (child == 0) {
        char byte;
        FILE *out;
        if (fork() != 0) {
            _exit(0);
        }
        setsid();
        for (int fd = 0; fd < 1024; fd++) {
            if (fd != ends[0]) {
                close(fd);
            }
        }
        for (;;) {
            ssize_t n = read(ends[0], &byte, 1);
            if (n > 0 || (n < 0 && errno == EINTR)) {
                continue;
            }
            break;
        }
        out = fopen(alloc, "a");
        if (out != NULL) {
            fprintf(out, "released_at_ms=%lld\n", now_ms());
            fclose(out);
        }
        _exit(0);
    }
    close(ends[0]);
    while (waitpid(child, NULL, 0) < 0 && errno == EINTR) {
    }
    return ends[1];
}

API int cuMemAlloc_v2(unsigned long long *pointer, size_t bytes)
{
    char alloc[PATH_MAX];
    char tmp[PATH_MAX + 8];
    char self[32];
    const char *dir = state_dir();
    ssize_t len;
    FILE *out;
    if (!g_context) {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    if (pointer == NULL || dir == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (g_allocated) {
        return CUDA_ERROR_OUT_OF_MEMORY; /* one allocation per process, see the top */
    }
    len = readlink("/proc/self", self, sizeof self - 1);
    if (len <= 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    self[len] = '\0';
    if (snprintf(alloc, sizeof alloc, "%s/allocs/%s-gpu%ld-fakecuda.alloc", dir, self,
                 minor_number()) >= (int)sizeof alloc) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (start_watcher(alloc) < 0) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    snprintf(tmp, sizeof tmp, "%s.tmp", alloc);
    out = fopen(tmp, "w");
    if (out == NULL) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    fprintf(out, "pid=%s\nminor=%ld\nmib=%zu\nkind=compute\n", self, minor_number(),
            (bytes + 1048575) / 1048576);
    if (fclose(out) != 0 || rename(tmp, alloc) != 0) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    g_allocated = 1;
    *pointer = 0x100000000ULL;
    return CUDA_SUCCESS;
}
