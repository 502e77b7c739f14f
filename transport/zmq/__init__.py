"""ZeroMQ: where sockets are made and their errors translated (sockets.py), the socket channel of a
queue, its link watch, lingering publishers and the received-memory heap setting. The only room that
touches a socket.
"""
