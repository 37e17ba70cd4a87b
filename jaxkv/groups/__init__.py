"""groups."""
