"""The compile room: the iteration IR, the authoring API, the compiler that expands an algorithm into
one iteration's DAG, its split over data-parallel ranks, and its rendering. Importable without torch."""
