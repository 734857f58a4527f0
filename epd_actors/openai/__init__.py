"""The OpenAI API, sans I/O: request schema and field rules, response and error formats,
media intake, and Server-Sent Events.

Pure, synchronous code shared by the front ends, the simulator's vLLM double and the HTTP
backend. Nothing here imports Trio or opens a socket (media fetching takes its fetcher from the
caller).
"""
