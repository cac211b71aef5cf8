"""Every access hf_ring makes to a private internal of an upstream library, one module per
library (``transformers``: a package, by concern), each with the versions it was written for."""
