"""The daemon's servers: the ingest socket (producers and subscriber connections) and the admin
socket.
"""
