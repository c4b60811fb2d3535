"""Ad-hoc sweep (device run 9): split counts / pipeline stages around the default quantized launch."""
import sys
sys.path.insert(0, "benchmarks")
import kernels as K  # noqa: E402

base = dict(path="vec", qblock=64, num_warps=2, num_stages=3, programs_per_sm=16, min_split=512, prefetch=False,
            vec_max_rows=1, trans_load=True)
cands = [dict(base)]
cands += [dict(base, programs_per_sm=p) for p in (5, 6, 10, 12, 20, 24, 32)]
cands += [dict(base, min_split=256), dict(base, min_split=1024), dict(base, num_stages=2), dict(base, num_stages=4)]
K.SWEEP_CONFIGS[:] = cands
sys.exit(K.main(sys.argv[1:]))
