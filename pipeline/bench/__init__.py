"""``rollplex bench``: policies side by side on a GPU, one process, one set of engines."""
