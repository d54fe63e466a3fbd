"""What the tests share: harnesses, fixtures that several files use, and small helpers, one
module per concern. A test file imports from here, never from another test file
(``tests/test_layers.py`` checks)."""
