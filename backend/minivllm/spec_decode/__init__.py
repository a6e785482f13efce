"""Speculative decoding: proposers (n-gram lookup, a draft model, early exit) and the exact
verification of their drafts by the target model."""
