"""Model definitions used by `infinity train` and the tests."""
