"""Test package: its modules are imported as `sim_pkg.<name>` (not `draftkv_sim`, which would shadow the package under test), so a basename may repeat in another folder (test_handoff.py)."""
