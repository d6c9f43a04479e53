/* Preloaded into a process (LD_PRELOAD), prints the native stack of the thread that faults, then
 * lets the process die as it would have. Python's fault handler shows Python's threads only; a
 * crash inside nvImageCodec happens in one of its own.
 *
 *   cc -shared -fPIC -o /tmp/native_stack.so examples/native_stack.c
 *   LD_PRELOAD=/tmp/native_stack.so python ...
 *
 * examples/fuzz.py --native-stacks does this for its workers. Frames print as library(+offset);
 * `addr2line -e LIB OFFSET` or the library's exported symbols name them. */
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static void on_fault(int sig)
{
    static const char head[] = "\n=== native stack of the faulting thread ===\n";
    void* frames[64];
    int n = backtrace(frames, 64);
    (void)!write(2, head, sizeof head - 1);
    backtrace_symbols_fd(frames, n, 2);
    signal(sig, SIG_DFL);
    raise(sig);
}

__attribute__((constructor)) static void install(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_fault;
    sigaction(SIGSEGV, &sa, 0);
    sigaction(SIGBUS, &sa, 0);
    sigaction(SIGABRT, &sa, 0);
}
