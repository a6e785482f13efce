"""Text in and out of the model: chat templates and tokenizer helpers, incremental
detokenization, stop strings."""
