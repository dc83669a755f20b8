"""lmrl: reinforcement-learning post-training of language models.

Shape notation used across the package:
    B  sequences in a batch (prompts x completions per prompt)
    G  group size: completions per prompt; sample i belongs to group i // G
    P  prompt tokens (left-padded)
    T  response tokens (right-padded)
    V  vocabulary size
"""

__version__ = "0.1.0"
