"""Test package: its modules are imported as `sim.<name>`, so a basename may repeat in another folder (test_handoff.py)."""
