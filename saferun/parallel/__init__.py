"""Parallelism: process groups and collectives (`distributed`) and the strategy object the loop
calls at named points (`strategy`)."""
