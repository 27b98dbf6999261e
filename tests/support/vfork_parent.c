/* A vfork() parent: it holds the files named on its command line, then vfork()s a child that
 * sleeps instead of exec'ing, so the parent waits in the kernel (state D) until the child exits.
 * Prints "PARENT CHILD\n" from the child (the parent cannot run) once the child sleeps. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (open(argv[i], O_RDWR) < 0) {
            perror(argv[i]);
            return 1;
        }
    }
    pid_t parent = getpid();
    pid_t child = vfork();
    if (child == 0) {
        char line[64];
        int n = snprintf(line, sizeof line, "%d %d\n", (int)parent, (int)syscall(SYS_getpid));
        syscall(SYS_write, 1, line, (size_t)n);
        struct timespec t = {600, 0};
        syscall(SYS_nanosleep, &t, NULL);
        syscall(SYS_exit, 0);
    }
    return child < 0;
}
