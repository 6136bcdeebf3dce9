// An AVX2-only CPU (AMD Zen 3 class: no AVX-512, no VNNI, no AMX) as cpuid shows it to a process, on a CPU that has
// more: run a command under benchmarks/avx2-only (which builds this as an LD_PRELOAD library). It turns on CPUID
// faulting (arch_prctl ARCH_SET_CPUID: the kernel's cpuid_fault flag, Intel since Ivy Bridge, AMD Zen 4 guests here)
// and answers each cpuid from a SIGSEGV handler: the real leaf with the AVX-512 / VNNI / AVX-VNNI / AMX bits cleared.
// Libraries that choose their kernels by cpuid (ORT's MLAS, numpy) then run their AVX2 code paths, natively: AVX2
// instructions compute the same on any CPU, so the results are an AVX2-only CPU's (timings are this CPU's running
// AVX2 code). The application's own SIGSEGV handler (Python's faulthandler) is kept and called for real faults.
// Measured with it (docs/server.md#continuous-batching): MatMulNBits int8 compute, one-row vs multi-row calls.
#define _GNU_SOURCE
#include <signal.h>
#include <ucontext.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <string.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#ifndef ARCH_SET_CPUID
#define ARCH_SET_CPUID 0x1012
#endif
static struct sigaction user_segv;  // the application's SIGSEGV disposition
static int have_user;
static int (*real_sigaction)(int, const struct sigaction *, struct sigaction *);

static void real_cpuid(uint32_t leaf, uint32_t sub, uint32_t r[4]) {
    __asm__ volatile("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(sub));
}

static void handler(int sig, siginfo_t *si, void *ctx) {
    ucontext_t *uc = ctx;
    unsigned char *ip = (unsigned char *)uc->uc_mcontext.gregs[REG_RIP];
    if (ip[0] == 0x0f && ip[1] == 0xa2) {
        uint32_t leaf = uc->uc_mcontext.gregs[REG_RAX], sub = uc->uc_mcontext.gregs[REG_RCX], r[4];
        syscall(SYS_arch_prctl, ARCH_SET_CPUID, 1);
        real_cpuid(leaf, sub, r);
        syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0);
        if (leaf == 7 && sub == 0) {
            r[1] &= ~((1u << 16) | (1u << 17) | (1u << 21) | (1u << 26) | (1u << 27) | (1u << 28) | (1u << 30)
                      | (1u << 31));  // AVX-512 F, DQ, IFMA, PF, ER, CD, BW, VL
            // AVX-512 VBMI, VBMI2, VNNI, BITALG, VPOPCNTDQ
            r[2] &= ~((1u << 1) | (1u << 6) | (1u << 11) | (1u << 12) | (1u << 14));
            // AVX-512 4VNNIW, 4FMAPS, VP2INTERSECT, AMX-BF16, AVX-512 FP16, AMX-TILE, AMX-INT8
            r[3] &= ~((1u << 2) | (1u << 3) | (1u << 8) | (1u << 22) | (1u << 23) | (1u << 24) | (1u << 25));
        } else if (leaf == 7 && sub == 1) {
            r[0] = 0; r[3] = 0;  // AVX-VNNI, AVX512_BF16, AVX-VNNI-INT8, AVX-IFMA ...
        }
        uc->uc_mcontext.gregs[REG_RAX] = r[0];
        uc->uc_mcontext.gregs[REG_RBX] = r[1];
        uc->uc_mcontext.gregs[REG_RCX] = r[2];
        uc->uc_mcontext.gregs[REG_RDX] = r[3];
        uc->uc_mcontext.gregs[REG_RIP] += 2;
        return;
    }
    if (have_user && (user_segv.sa_flags & SA_SIGINFO) && user_segv.sa_sigaction) {
        user_segv.sa_sigaction(sig, si, ctx);
        return;
    }
    if (have_user && user_segv.sa_handler != SIG_DFL && user_segv.sa_handler != SIG_IGN) {
        user_segv.sa_handler(sig);
        return;
    }
    struct sigaction dfl = {0};
    dfl.sa_handler = SIG_DFL;
    real_sigaction(SIGSEGV, &dfl, NULL);  // a real fault: default action when the instruction reruns
}

int sigaction(int sig, const struct sigaction *act, struct sigaction *old) {
    if (!real_sigaction) real_sigaction = dlsym(RTLD_NEXT, "sigaction");
    if (sig != SIGSEGV) return real_sigaction(sig, act, old);
    if (old) { if (have_user) *old = user_segv; else { memset(old, 0, sizeof *old); old->sa_handler = SIG_DFL; } }
    if (act) { user_segv = *act; have_user = 1; }
    return 0;
}

__attribute__((constructor)) static void init(void) {
    real_sigaction = dlsym(RTLD_NEXT, "sigaction");
    struct sigaction sa = {0};
    sa.sa_sigaction = handler;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    real_sigaction(SIGSEGV, &sa, NULL);
    if (syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0) != 0) { perror("avx2only: ARCH_SET_CPUID"); }
}
