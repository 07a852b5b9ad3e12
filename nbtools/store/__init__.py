"""Where a table's rows live: the row store, its GPU cache of hot rows, the row layout."""
