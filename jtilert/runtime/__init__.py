"""Running a model: compiled decode steps and `Generator` (`generate`), sampling, the tokenizer and
the persistent compilation cache."""
