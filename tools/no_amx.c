/* An Intel CPU without AMX, on one with it: a preload library that refuses the process's request for AMX's tile
 * state (`arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)`), as a kernel that does not grant it does. burn-te's probe
 * then never sees `amxbf16` (`HostGemmPath::available`), and PyTorch's oneDNN falls back to its AVX-512 kernels
 * (`ONEDNN_VERBOSE=1` prints `isa:Intel AVX 10.1` without AMX), so both sides of a comparison run as they would on
 * a Xeon whose kernel withholds AMX (the Emerald Rapids of issue 45). The cores, caches and clocks stay this CPU's:
 * it stands in for a Xeon without AMX of the same generation, not for older ones.
 *
 *     gcc -O2 -shared -fPIC -o /tmp/no_amx.so tools/no_amx.c -ldl
 *     BURN_TE_HOST_GEMM_CACHE=off LD_PRELOAD=/tmp/no_amx.so python3 tools/torch_transformer_layer.py \
 *         --hidden 1024 --threads 2 --steps 6 --rounds 3 --vs-burn-te "cargo bench -q --bench host_gemm --"
 *
 * (`BURN_TE_HOST_GEMM_CACHE=off`, or a directory of its own: the choices cached on disk by a run with AMX name
 * `amxbf16`.) Only `syscall(2)` through libc is caught, which is how both ask; everything else passes through.
 * Optional and not part of CI. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <sys/syscall.h>

#define ARCH_REQ_XCOMP_PERM 0x1023

long syscall(long number, ...) {
    va_list args;
    va_start(args, number);
    long a[6];
    for (int i = 0; i < 6; i++) a[i] = va_arg(args, long);
    va_end(args);
    if (number == SYS_arch_prctl && a[0] == ARCH_REQ_XCOMP_PERM) {
        errno = EPERM;
        return -1;
    }
    static long (*next)(long, ...);
    if (!next) next = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
    return next(number, a[0], a[1], a[2], a[3], a[4], a[5]);
}
