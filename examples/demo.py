"""`make demo`: speculative generation on a tiny random model pair (see hf_sparsekv/demo.py)."""

from hf_sparsekv.demo import main

raise SystemExit(main())
