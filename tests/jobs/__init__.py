"""User jobs written for the tests: what the contract must accept and what it must refuse."""
