"""What `plan profile` does without --prompts, in one place that needs no torch: the command line states it in
`--help`, and profiling.py does it."""
RANDOM_PROMPTS, PROMPT_LEN, SEED = 8, 32, 0  # prompts of random token ids: how many, how long, the seed
