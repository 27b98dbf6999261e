/*
 * A "libnvidia-ml.so.1" that a service user plants in a directory on the watched unit's
 * LD_LIBRARY_PATH (tests/e2e/test_privsep.py). Its constructor runs in every dynamically linked
 * program that loads it and says who that was: a line "PLANTED-NVML uid=U euid=E pid=P" on
 * standard error (the journal, whatever the program's sandbox) and a marker file
 * /srv/markers/nvml-uidE. gpuguard's root side must never be one of them.
 */
#include <stdio.h>
#include <unistd.h>

__attribute__((constructor)) static void planted(void)
{
    char path[64];
    FILE *marker;

    fprintf(stderr, "PLANTED-NVML uid=%u euid=%u pid=%d\n", (unsigned)getuid(),
            (unsigned)geteuid(), (int)getpid());
    snprintf(path, sizeof path, "/srv/markers/nvml-uid%u", (unsigned)geteuid());
    marker = fopen(path, "a");
    if (marker != NULL) {
        fprintf(marker, "%d\n", (int)getpid());
        fclose(marker);
    }
}
