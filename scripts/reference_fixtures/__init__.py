"""The reference-fixture builder's parts (scripts/make_reference_fixtures.py is the entry point)."""
