# SPDX-License-Identifier: Apache-2.0
"""Connectors between AFD attention and FFN ranks."""
