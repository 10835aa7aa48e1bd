export function ErrorBanner({ message, onDismiss }: { message: string | null; onDismiss: () => void }) {
  if (!message) return null;
  return (
    <div className="error-banner" role="alert" data-testid="error-banner">
      <span className="error-text">{message}</span>
      <button type="button" className="icon-button" aria-label="Dismiss error" title="Dismiss" onClick={onDismiss}>
        ×
      </button>
    </div>
  );
}
