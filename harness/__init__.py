"""harness: is this CUDA out-of-memory a code problem or a card problem?"""

__version__ = "0.1.0"
