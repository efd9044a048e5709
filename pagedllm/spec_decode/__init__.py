"""Speculative decoding: draft proposers (ngram_proposer.py, plain Python and numpy) and the verification of the
drafts against the target model's distributions (rejection_sampler.py, torch)."""
