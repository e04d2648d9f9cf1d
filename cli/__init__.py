"""The ``duebox`` command: the one place that wires everything together."""
