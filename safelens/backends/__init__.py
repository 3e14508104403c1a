"""One adapter per model family; each is the only code that imports its model library."""
