// A few inline icons (system fonts lack the media-control glyphs).
const PATHS = {
  play: "M5 3.5v9l8-4.5z",
  pause: "M4 3h3v10H4zM9 3h3v10H9z",
  prev: "M3 3h2v10H3zM13 3v10L6 8z",
  next: "M11 3h2v10h-2zM3 3v10l7-5z",
} as const;

export function Icon(props: { name: keyof typeof PATHS }) {
  return (
    <svg width="14" height="14" viewBox="0 0 16 16" aria-hidden="true" focusable="false">
      <path d={PATHS[props.name]} fill="currentColor" />
    </svg>
  );
}
