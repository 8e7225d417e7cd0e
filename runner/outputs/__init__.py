"""Readers of what runs leave behind (torch-free): goodput, the term breakdown of a trace, runs compared."""
