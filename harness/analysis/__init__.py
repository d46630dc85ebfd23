"""Reading the numbers: which kind of memory, the timeline shape, code problem or card problem."""
