"""The detokenizer process: incremental detokenization of the scheduler's token ids, stop
strings, and the batched text outputs sent to the tokenizer manager."""
