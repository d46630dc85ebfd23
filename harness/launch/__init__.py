"""Launchers: how points reach the machines that run them."""
