"""inferlab's Triton kernels that several plugins or the core use: each module computes one thing
(an RMSNorm, the K/V store, a split-K GEMM, sampling, ...) and pdl.py says how they launch.

Triton fixes at import whether a kernel is compiled or interpreted (TRITON_INTERPRET=1, the only
way it runs on CPU), so a kernel module is imported only where its kernels run; this package
itself imports nothing."""
