"""Networks as graphs: topologies as data, placement of ranks, routing into incidence arrays.

``graph`` holds the :class:`Topology` data type, ``generators`` the compact ways to write one,
``flow`` max-flow and bisection bandwidth, ``routing`` shortest-path ECMP routes as
``(flows, links)`` incidence arrays, ``collectives`` the placement of a plan's ranks and the
step flows of collective algorithms, ``load`` the strict YAML presets of
``configs/topologies``. Everything here is numpy, computed once outside jit.
"""
