"""The run side (named apart from the top-level launch/ scripts): the launch command line and its supervision
(launcher), the checks before any process starts and any file is written (preflight; the data sampled with a
size limit: data_check), the CPU rehearsal of a plan's strategy (rehearsal),
and the tiny models and corpora the rehearsal, demo and tests train (tiny)."""
