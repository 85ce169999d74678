"""Native kernels (C++ extensions) with pure-torch references and fallbacks."""
