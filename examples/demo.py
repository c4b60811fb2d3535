"""`make demo`: speculative generation with the bundled trained pair on a held-out document (see hf_sparsekv/demo.py)."""

from hf_sparsekv.demo import main

raise SystemExit(main())
